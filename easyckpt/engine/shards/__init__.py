"""The trainer's halves of the shard formats, used both ways: a state tree split into tensors and a skeleton
(tree.py), each format's flatten and decode (codecs.py), tensors out of the bytes a format describes
(shardload.py)."""
