"""``python -m vendors.simulator``: serve the simulator (see the package docstring)."""

from vendors.simulator import main

if __name__ == "__main__":
    main()
