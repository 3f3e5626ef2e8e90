"""The process's runtime: worker processes, memory, quiet libraries, debugging, profiling."""
