"""runner/graphs: captured decode steps. The seam every graph runner keeps (graph_runner.py), CUDA graphs
(cuda_graph_runner.py, imported on CUDA only) and the torch.compile'd CPU step (cpu_graph_runner.py)."""
