"""Code that builds a session's state worth keeping, and code that checks it came back."""

BUILD = """
import pandas as pd, numpy as np
from sklearn.linear_model import LinearRegression
df = pd.DataFrame({"x": np.arange(1_000_000), "y": np.arange(1_000_000) * 2.0})
model = LinearRegression().fit(df[["x"]].head(1000), df["y"].head(1000))
same = df
SCALE = 3
def triple(v):
    return v * SCALE
class Point:
    def __init__(self, x):
        self.x = x
    def doubled(self):
        return Point(triple(self.x) - self.x)
p = Point(2)
gen = (i for i in range(3))
import os
os.makedirs("data", exist_ok=True)
open("data/notes.txt", "w").write("kept")
"""

# After SCALE = 10: a function defined in a cell still reads the namespace's globals.
CHECK = """
SCALE = 10
print(len(df), same is df, round(float(model.predict([[10]])[0]), 3), triple(2),
      p.doubled().x, type(p) is Point, open("data/notes.txt").read(), 'gen' in globals())
"""
CHECKED = ["1000000", "True", "20.0", "20", "18", "True", "kept", "False"]
