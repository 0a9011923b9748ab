"""One heavy case in a process of its own, so its peak memory is its own: `who case`."""

from __future__ import annotations

import asyncio
import json
import sys

from bench import ours, raw, workloads
from bench.stats import peak_rss_mb

CASES = {"stdout_10mb": workloads.BIG_STDOUT, "image_5mb": workloads.BIG_IMAGE}


async def main(who: str, case: str) -> dict[str, float]:
    code = CASES[case]
    before = peak_rss_mb()
    seconds = await (raw.heavy(code) if who == "raw" else ours.heavy(who, code))
    return {"seconds": seconds, "peak_mb": peak_rss_mb(), "base_mb": before}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
