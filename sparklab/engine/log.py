"""vLLM-style log lines: ``(APIServer pid=N) INFO 05-01 19:26:40 [file.py:12] message``."""
import logging
import os
import sys


class _Formatter(logging.Formatter):
    def __init__(self, prefix: str):
        super().__init__("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                         datefmt="%m-%d %H:%M:%S")
        self.prefix = prefix

    def format(self, record):
        return self.prefix + super().format(record)


def get_logger(role: str = "APIServer") -> logging.Logger:
    logger = logging.getLogger("vllm")
    if not logger.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(_Formatter(f"({role} pid={os.getpid()}) "))
        logger.addHandler(h)
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
        logger.setLevel(getattr(logging, level, logging.INFO))
        logger.propagate = False
    return logger
