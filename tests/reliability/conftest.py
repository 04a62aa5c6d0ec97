"""The reliability suite runs on the same 2-host lab as tests/lab, in the same pytest session:
the `lab` fixture is tests/conftest.py's, one lab per session whichever suite asks first (run
alone, `pytest tests/reliability` brings a fresh lab up and down itself). Without root or one of
the lab's tools it is a skip that names what is missing, and under CI (CI=true) a failure."""
