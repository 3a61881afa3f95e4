"""Inter-process mechanics on one node: the shared-memory slots and their one reader, the job key, the
agent's socket, the agent-to-agent wire and the reaping of dead jobs' memory. Shared by the training
processes and the agent; nothing here imports torch, either process's code or the save directory."""
