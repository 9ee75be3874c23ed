import os
import sys

# the shared graph builders live next to the tests
sys.path.insert(0, os.path.dirname(__file__))
