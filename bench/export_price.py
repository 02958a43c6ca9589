"""The price of exporting: for each golden plan in plans/, each engine's exported configuration
(`hetplan export --to ENGINE`) compiled as that engine's baseline on the golden's own model,
machine and workload, its predicted TTFT and TPOT next to the plan's.

    python bench/export_price.py            # a Markdown table (bench/RESULTS.md, "Export price")

Predictions only (the cost model's replay), deterministic; "n/a" where the engine can express
no part of the plan, "does not fit" where the exported configuration overruns a memory budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.export.result import ENGINES, CannotExpress, export, price
from hetplan.plan import load_plan
from hetplan.units import format_seconds

PLANS = Path(__file__).resolve().parent.parent / "plans"


def cell(plan, engine: str) -> str:
    try:
        cost = price(plan, export(plan, engine))
    except CannotExpress:
        return "n/a"
    except HetplanError as e:
        return f"error: {e}"
    p, e = plan.predicted, cost.plan.predicted
    text = (f"{format_seconds(e['ttft_s'])} ({e['ttft_s'] / p['ttft_s']:.2f}x) / "
            f"{format_seconds(e['tpot_s'])} ({e['tpot_s'] / p['tpot_s']:.2f}x)")
    return text + (" does not fit" if cost.missing_bytes else "")


def main() -> int:
    print("| golden | plan TTFT / TPOT | " + " | ".join(ENGINES) + " |")
    print("|---|---|" + "---|" * len(ENGINES))
    for path in sorted(PLANS.glob("*.json")):
        plan = load_plan(path, verify=False)
        p = plan.predicted
        row = [path.stem, f"{format_seconds(p['ttft_s'])} / {format_seconds(p['tpot_s'])}"]
        row += [cell(plan, engine) for engine in ENGINES]
        print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
