import torch

# Small models: one thread per process is fastest and keeps 2 cores responsive.
torch.set_num_threads(1)
