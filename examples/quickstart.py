"""A small data-analysis job, the kind an agent runs: build data, summarize it, chart it."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

rng = np.random.default_rng(7)
sales = pd.DataFrame(
    {
        "month": pd.period_range("2026-01", periods=12, freq="M").astype(str),
        "revenue": rng.normal(120, 15, 12).round(1),
        "costs": rng.normal(90, 10, 12).round(1),
    }
)
sales["margin"] = sales.revenue - sales.costs
print(sales.describe().round(1).to_string())
best = sales.loc[sales.margin.idxmax()]
print(f"\nBest month: {best.month} with a margin of {best.margin:.1f}")

ax = sales.plot(x="month", y=["revenue", "costs"], marker="o", figsize=(8, 4))
ax.set_title("Revenue and costs, 2026")
plt.tight_layout()
plt.show()
