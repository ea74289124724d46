"""`tandem bench`: each benchmark measures tandem and its baseline in the same run."""
