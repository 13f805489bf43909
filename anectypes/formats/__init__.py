"""Model files, one module per format with its reader beside its writer: checkpoint (ours, resumable),
llama2c (run.c's model.bin), hf (Hugging Face Llama folders), gguf (llama.cpp's), reference (the
reference's v2/v4 checkpoints, read only). portable is the model they read into and write from (α
folded and unfolded, the checks they share); export writes one safely. Which format a path holds,
and with which tokenizer: anectypes.sources."""
