import sys

from .cli import main
from .engine import run

sys.exit(main(run=run))
