"""Model runners behind one contract (base.py); select.py picks and builds one."""
