"""Model file formats: safetensors, GGUF, llama2.c checkpoints, anelm's quantized folders and
PEFT adapter folders, each read into (and written from) HF's names and layouts."""
