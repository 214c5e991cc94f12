"""Developer tools: the GPU check and its carried build, the ptxas check, the sanitizer subset."""
