"""The benchmarks behind `python -m anectypes.bench` (cli.py): one module per subcommand (peak, int8,
dispatch, train), each with its program or workload, its run and its table; what they share: the timing
harness (timing.py), the JSON report and its system block (report.py) and the table renderer (table.py).
torch_model.py is the anectypes model in PyTorch for `train --compare torch`."""
