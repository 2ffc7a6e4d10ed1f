"""The target model as the engine runs it: loading and tokenizer (`loading`), our forward over the paged KV pools
(`forward`), fused Llama-family layers, packed linear layers. Imports KV and the backend."""
