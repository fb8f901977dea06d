import sys
from pathlib import Path

# tests import the stand-in models in tests/toy.py as `toy`
sys.path.insert(0, str(Path(__file__).parent))
# and the project's packages (engine, cluster, jobs) from this checkout, installed or not
if str(Path(__file__).parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parents[1]))
