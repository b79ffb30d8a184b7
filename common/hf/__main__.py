"""python -m common.hf export ...: common/hf/interop.py's command line."""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
from common.hf.interop import main

if __name__ == "__main__":
    main()
