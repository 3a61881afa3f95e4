"""Storage back-ends. Only POSIX file systems for now; object stores would sit behind the same verbs."""
