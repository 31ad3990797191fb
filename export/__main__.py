"""`python -m export RUN_DIR ...`: the command line of `export.write`."""

from export.write import main

main()
