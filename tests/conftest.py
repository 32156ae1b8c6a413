"""Session-wide test environment: HF libraries stay offline (they read these at import)."""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
