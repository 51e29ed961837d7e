"""Rewards: rule-based math scoring (math), the digit tasks' reward (digits) and reward functions
chosen by import path, with batch scoring (loader)."""
