"""Running a rank's slice: the stage program interpreter, its segments, their compile cache."""
