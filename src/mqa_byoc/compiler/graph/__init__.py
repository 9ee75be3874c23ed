"""Graph-side stages of the partition: finding attention, proving what it computes, rewriting it."""
