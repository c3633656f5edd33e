"""The test suite. Imported before its conftest and before anything loads torch's OpenMP
runtime, so that here, in this process and (inherited) in every process the tests start, a
thread waiting at a barrier sleeps rather than spins: the parallel suite runs more compute
threads than the machine has cores, and spinning ones take the cores the others need. Three
copies of one SmolLM2 test side by side on 2 vCPUs took 205 s spinning and 51 s sleeping (one
alone: 24 s)."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
