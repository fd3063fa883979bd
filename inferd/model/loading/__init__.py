"""Loading a checkpoint (GGUF file or Hugging Face folder) into the layers' weights."""
