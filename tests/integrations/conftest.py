import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_env, imported by the tests and the child programs
