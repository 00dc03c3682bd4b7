"""tide/models"""
