"""How fast the calculator answers (targets: `batchlab estimate` < 0.5 s from process start,
`--vary` over 1,000 values < 1 s).  Run by hand: .venv/bin/python benchmarks/estimate_speed.py"""
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).with_name("batchlab")


def wall(args: list[str], repeats: int = 5) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([str(BIN), *args], check=True, capture_output=True)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    values = ",".join(str(v) for v in range(1, 1001))
    cases = {
        "python -c pass (interpreter floor)": None,
        "batchlab estimate": ["estimate"],
        "batchlab estimate --json (llama-2-7b)": ["estimate", "--model", "llama-2-7b", "--seq", "4096",
                                                 "--micro-batch", "1", "--device", "h100-sxm", "--json"],
        "batchlab estimate --vary accum=1..1000 --keep accum --json":
            ["estimate", "--vary", f"accum={values}", "--keep", "accum", "--json"],
        # target <= 60 s; the test suite traces 4 of the 32 layers (tests/trace/test_trace.py)
        "batchlab estimate --trace --json (llama-2-7b, seq 4096, ac full, all 32 layers)":
            ["estimate", "--trace", "--model", "llama-2-7b", "--seq", "4096", "--micro-batch", "1", "--ac", "full",
             "--json"],
    }
    print("| command | median s | min s | max s |\n|---|---|---|---|")
    for name, args in cases.items():
        if args is None:
            samples = []
            for _ in range(5):
                t = time.perf_counter()
                subprocess.run([sys.executable, "-c", "pass"], check=True)
                samples.append(time.perf_counter() - t)
        else:
            samples = wall(args)
        print(f"| {name} | {statistics.median(samples):.3f} | {min(samples):.3f} | {max(samples):.3f} |")


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    page.publish(main, "estimate_speed", "How fast the calculator answers")
