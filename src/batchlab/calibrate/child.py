"""``python -m batchlab.calibrate.child ARGS_JSON OUT``: ``measure_here`` in a fresh process batchlab started in its
allocator regime (calibrate.run.measure; never a fork, whose shared heap pages would slow the first writes the
kernels are timed on), the Calibration written to OUT as JSON."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from batchlab.calibrate.run import measure_here
from batchlab.util.lifeline import guard


def main(argv: list[str]) -> None:
    guard()  # never outlive the caller
    args, out = json.loads(argv[0]), Path(argv[1])
    shapes = tuple(map(tuple, args["shapes"])) if args.get("shapes") else None
    cal = measure_here(args["torch_device"], args["seconds"], shapes, args.get("threads"), args.get("rounds"),
                       tuple(args["scope"]))
    out.write_text(json.dumps(cal.to_dict()))


if __name__ == "__main__":
    main(sys.argv[1:])
