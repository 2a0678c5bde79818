"""One agent episode: the pinned qwen-code runtime, the logging proxy between the agent and the model server, SSE
reassembly of streamed completions, outcome classification and the pool that runs episodes concurrently."""
