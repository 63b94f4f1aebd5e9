"""The ``clusterflow`` command line: argument parsing and printing only."""
