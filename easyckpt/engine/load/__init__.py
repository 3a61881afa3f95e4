"""What runs when a job resumes: the sources a state can come from (sources.py), the ranks' agreement on which
(agree.py), and the walk over them (newest.py)."""
