"""runner/memory: the KV pools (kv_pool.py), the memory saver that releases and resumes tagged regions
(memory_saver.py), and the runner's release/resume/shutdown logic on top of it (occupation.py)."""
