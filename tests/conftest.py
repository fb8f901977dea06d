import sys
from pathlib import Path

# tests import the stand-in models in tests/toy.py as `toy`
sys.path.insert(0, str(Path(__file__).parent))
