"""Models: configs, the dynamic-weight MIL kernels and their packing layouts, CPU ops."""
