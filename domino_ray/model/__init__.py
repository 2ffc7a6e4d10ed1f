"""The target model as the engine runs it: loading and tokenizer, our forward over a paged KV pool, fused
Llama-family layers, packed linear layers, and the attention over each row's keys. Imports the backend only."""
