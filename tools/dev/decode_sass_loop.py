"""Static instruction counts of the decode kernel's main loop (the innermost backward branch around its
HMMAs) per kernel of a cubin, for work on an issue-bound step without a GPU:

    nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -cubin -o /tmp/k.cubin src/mqa_byoc/native/gqa_decode.cu
    python tools/dev/decode_sass_loop.py /tmp/k.cubin [mangled-name fragments ...]

A count is of the loop's code, not of one iteration's path: a branch the loop takes per tile (a whole tile
or the last one) counts both sides. cuobjdump: CUOBJDUMP, else on PATH."""
import collections
import os
import re
import shutil
import subprocess
import sys

CUOBJ = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or "cuobjdump"
sass = subprocess.run([CUOBJ, "-sass", sys.argv[1]], capture_output=True, text=True).stdout
funcs = re.split(r"\n\s+Function : ", sass)[1:]
want = sys.argv[2:] or ["I6__halfLi64ELb0ELb0ELb1ELi8E", "I6__halfLi128ELb1ELb0ELb1ELi8E", "I6__halfLi64ELb0ELb0ELb1ELi4E", "I6__halfLi128ELb1ELb0ELb1ELi4E", "I6__halfLi128ELb0ELb0ELb1ELi8E"]
for f in funcs:
    name = f.split("\n", 1)[0]
    tag = next((w for w in want if w in name), None)
    if not tag:
        continue
    ins = []
    for line in f.split("\n"):
        m = re.search(r"/\*([0-9a-f]{4,5})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z0-9_.]+)\s*([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    hmma = [a for a, op, _ in ins if op.startswith("HMMA")]
    best = None
    for a, op, arg in ins:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", arg)
            if t:
                tgt = int(t.group(1), 16)
                if tgt < a and any(tgt <= h <= a for h in hmma):
                    if best is None or a - tgt < best[1] - best[0]:
                        best = (tgt, a)
    lo, hi = best
    body = [(a, op) for a, op, _ in ins if lo <= a <= hi]
    ops = collections.Counter(op.split(".")[0] for _, op in body)
    print(f"{tag}: loop {len(body)} instr, HMMA {ops['HMMA']}, LDGSTS {ops['LDGSTS']}, LDSM {ops['LDSM']}, "
          f"IMAD {ops['IMAD']}, SEL {ops['SEL']}, LOP3 {ops['LOP3']}, IADD3 {ops['IADD3']}, FSETP {ops['FSETP']}, FSEL {ops['FSEL']}")
    print("   ", ", ".join(f"{k} {v}" for k, v in ops.most_common(30)))
