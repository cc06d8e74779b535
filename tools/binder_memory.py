"""Peak memory of every notebook, each in a fresh kernel, against mybinder.org's 2 GB; run by tools/binder_check.sh.

    python tools/binder_memory.py --notebooks notebooks --out benchmarks/results/binder-memory-cpu.json

Each notebook runs top to bottom (gmlx_lab.book.run.execute, in file order, so the first notebook that loads
Gemma 3 270M also converts it, as on a new Binder) while its kernel's resident memory, the kernel and any child
process, is sampled every 50 ms. The budget is 80% of 2 GB, counted as 2e9 bytes (a Kubernetes "2G"; read as
2 GiB the spare only grows). Exit status 1 when a notebook fails or goes over.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from gmlx_lab.book import PeakMemory, execute

LIMIT = 2_000_000_000  # mybinder.org's memory limit per user, "2 GB"
SPARE = 0.20  # the share of it left unused at every notebook's peak
BUDGET = int(LIMIT * (1 - SPARE))


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("mlx", "mlx-lm", "jupyterlab", "ipykernel", "ipywidgets", "plotly",
                                             "transformers", "tokenizers", "nbclient")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", default="notebooks")
    parser.add_argument("--out", required=True, help="the JSON result to write")
    parser.add_argument("--commit", default=os.environ.get("GMLX_COMMIT", ""), help="the commit measured")
    args = parser.parse_args(argv)
    paths = sorted(Path(args.notebooks).glob("*.ipynb"))
    if not paths:
        parser.error(f"no notebooks in {args.notebooks}")
    rows, failed, kernels = [], [], set()

    for path in paths:
        sampler = PeakMemory()

        def started(pid: int, sampler: PeakMemory = sampler) -> None:
            import psutil

            kernels.add(psutil.Process(pid).cmdline()[0])  # the environment's own Python, not another kernelspec's
            sampler.watch(pid)

        try:
            run = execute(path, on_kernel=started, env={"PLOTLY_RENDERER": "plotly_mimetype"})
            seconds, error = round(run.seconds, 1), None
        except Exception as exc:  # recorded and reported; the other notebooks still run
            seconds, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        peak = sampler.stop()
        row = {"notebook": path.name, "peak_bytes": peak, "peak_mb": round(peak / 1e6), "seconds": seconds,
               "share_of_limit": round(peak / LIMIT, 3), "fits": error is None and peak <= BUDGET}
        if error:
            row["error"] = error
        rows.append(row)
        print(f"[binder] {path.name}: peak {peak / 1e6:.0f} MB ({peak / LIMIT:.0%} of 2 GB), {seconds} s"
              f"{'' if row['fits'] else '  OVER BUDGET OR FAILED: ' + (error or f'over {BUDGET / 1e6:.0f} MB')}",
              flush=True)
        if not row["fits"]:
            failed.append(path.name)
    result = {
        "what": "peak resident memory of each notebook's kernel (process tree, sampled every 50 ms), one fresh "
                "kernel per notebook, in the environment tools/binder_check.sh builds from binder/",
        "limit_bytes": LIMIT, "budget_bytes": BUDGET, "spare": SPARE,
        "date": datetime.date.today().isoformat(), "commit": args.commit,
        "machine": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0], "executable": sys.executable,
                    "kernel_python": sorted(kernels), "blas": os.environ.get("LD_PRELOAD") or "MLX's bundled BLAS"},
        "versions": versions(), "all_fit": not failed, "notebooks": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"[binder] {'all fit' if not failed else 'FAILED: ' + ', '.join(failed)}; written {args.out}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
