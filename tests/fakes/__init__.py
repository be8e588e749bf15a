"""Test doubles (stand-ins for what this machine lacks, such as GPUs)."""
