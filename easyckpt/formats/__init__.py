"""What the trainer processes and the agent agree on, as definitions and validators: the shard formats
(shardformat.py), the protocol's requests and replies, the slot metadata, the manifest, the shard file, the
torch.save zip layout, the save directory's names (layout.py), the loader's verdicts and path checks.
Nothing here imports torch, the inter-process mechanics (ipc/) or the save directory (storage/)."""
