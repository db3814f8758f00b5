"""What a run claims about its privacy: the plan (accountant, calibration, report) and the
client- and sample-level claims."""
