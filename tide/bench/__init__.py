"""tide/bench"""
