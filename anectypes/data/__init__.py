"""Data: the llama2.c tokenizer and its BPE training, token files and the training-window sampler, the built-in
corpus."""
