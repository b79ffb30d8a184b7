"""python -m common.hf export ...: common/hf/interop.py's command line."""
from common.hf.interop import main

if __name__ == "__main__":
    main()
