"""Model definitions. One decoder family today: Llama (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)."""
