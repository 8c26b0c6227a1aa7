#!/usr/bin/env python3
"""Instructions per call, from a callgrind output file.

    python3 bench/callgrind_calls.py CALLGRIND_OUT CALLER [CALLER...]

For each function whose name starts with CALLER, prints every function it
calls with the number of calls and the instructions (Ir) per call,
inclusive of everything the callee runs in user space:

    calls caller=one_read callee=krcore::abi::ops::post_send calls=2002 ir_per_call=885.1

Reads the format callgrind writes (name compression "(id) name", then
"(id)"; a "calls=N ..." line followed by the line holding the call's
inclusive cost, after one position per name in "positions:", which is
two with --dump-instr=yes); see valgrind's callgrind format specification.
"""
import re
import sys
from collections import defaultdict

NAME = re.compile(r"^\((\d+)\)(?: (.*))?$")


def parse(path):
    names = {}  # fn / cfn share one compression table
    objs = {}  # ob / cob share one
    fn = None
    callee = None
    pending_calls = None
    npos = 1
    out = defaultdict(lambda: [0, 0])  # (caller, callee) -> [calls, Ir]

    def name_of(table, spec):
        m = NAME.match(spec)
        if not m:
            return spec
        key, name = m.group(1), m.group(2)
        if name is not None:
            table[key] = name
        return table.get(key, spec)

    with open(path) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if line.startswith("positions:"):
                npos = len(line.split()) - 1
            elif line.startswith("fn="):
                fn = name_of(names, line[3:])
            elif line.startswith("cfn="):
                callee = name_of(names, line[4:])
            elif line.startswith(("ob=", "cob=")):
                name_of(objs, line.split("=", 1)[1])
            elif line.startswith("calls="):
                pending_calls = int(line[6:].split()[0])
            elif pending_calls is not None and line and (line[0].isdigit() or line[0] in "+-*"):
                parts = line.split()
                ir = int(parts[npos]) if len(parts) > npos else 0
                entry = out[(fn, callee)]
                entry[0] += pending_calls
                entry[1] += ir
                pending_calls = None
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    calls = parse(sys.argv[1])
    for prefix in sys.argv[2:]:
        rows = [(caller, callee, n, ir) for (caller, callee), (n, ir) in calls.items()
                if caller and caller.startswith(prefix) and n > 0]
        for caller, callee, n, ir in sorted(rows, key=lambda r: -r[3]):
            print(f"calls caller={prefix} callee={callee} calls={n} ir_per_call={ir / n:.1f}")


if __name__ == "__main__":
    main()
