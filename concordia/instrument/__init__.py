"""PTX instrumentation: exit hooks, pause gates and store tracking inserted into kernels as they load."""
