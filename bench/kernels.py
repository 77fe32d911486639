"""Update-kernel benchmark: rudra_zmq.kernels beside NumPy, torch and a plain copy.

A thin wrapper: the benchmark is ``rudra-zmq bench kernels`` (rudra_zmq/benchmarks/kernels.py,
where every option and figure is described); this script runs it with the same options.

    python bench/kernels.py                       # 1M 10M 100M, 1 and 2 threads, ~2 minutes
    python bench/kernels.py --sizes 10M --threads 2 --reps 30 --csv bench/out/k.csv
"""
import sys

from rudra_zmq.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "kernels", *sys.argv[1:]]))
