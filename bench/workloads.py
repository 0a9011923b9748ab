"""The code every contender runs, so that the figures compare like with like."""

TRIVIAL = "1+1"
FIGURE = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
FIGURE_SETUP = "import matplotlib.pyplot as plt\nplt.plot([0]); plt.show()"  # warm the import
BIG_STDOUT = "import sys\nsys.stdout.write('x' * (10 * 1024 * 1024))"  # 10 MB
BIG_IMAGE = (  # a 5 MB PNG
    "import io, numpy as np\n"
    "from PIL import Image\n"
    "from IPython.display import display, Image as Show\n"
    "px = np.random.default_rng(0).integers(0, 255, (1300, 1300, 3), dtype=np.uint8)\n"
    "b = io.BytesIO(); Image.fromarray(px).save(b, format='PNG')\n"
    "display(Show(data=b.getvalue(), format='png'))"
)
