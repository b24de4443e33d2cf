"""Tests of the tower agent."""
