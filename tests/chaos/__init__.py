"""Faults and races at scale: random kills, database outages, racing workers, hostile input,
secret canaries (the long chaos run is `pytest -m chaos --trials 1000`)."""
