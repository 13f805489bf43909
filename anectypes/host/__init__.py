"""What runs on the CPU beside the device: BLAS, fp16 numerics, pieces and lanes over cores, atomic
files, processes and machine facts."""
